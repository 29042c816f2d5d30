//! Render figures without the kvbench binary: `cargo run -p kvbench-plots --example
//! render -- results/EXP [fig1,fig3] [MODEL]`.
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let dir = args.next().ok_or("usage: render DIR [FIGURES] [MODEL]")?;
    let figs = match args.next() {
        Some(f) if f != "all" => kvbench_plots::parse_figures(&f)?,
        _ => kvbench_plots::FigureId::ALL.to_vec(),
    };
    let ctx = kvbench_plots::Context {
        model: args.next(),
        out_dir: None,
    };
    for r in kvbench_plots::render(std::path::Path::new(&dir), &figs, &ctx)? {
        println!("{r}");
    }
    Ok(())
}

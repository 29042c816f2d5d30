//! report.html from the report's Markdown.

use std::fmt::Write as _;

/// Markdown to a self-contained HTML page: headings, lists, tables, paragraphs and the
/// inline images this report produces (not a general Markdown renderer).
pub(crate) fn to_html(md: &str, title: &str) -> String {
    let esc = |s: &str| {
        s.replace('&', "&amp;")
            .replace('<', "&lt;")
            .replace('>', "&gt;")
    };
    let inline = |s: &str| {
        let mut out = String::new();
        let mut bold = false;
        let mut it = s.split("**");
        if let Some(first) = it.next() {
            out.push_str(&esc(first));
        }
        for part in it {
            bold = !bold;
            out.push_str(if bold { "<b>" } else { "</b>" });
            out.push_str(&esc(part));
        }
        out
    };
    let mut html = format!(
        "<!doctype html><html><head><meta charset=\"utf-8\"><title>{}</title><style>\
         body{{font-family:sans-serif;max-width:1100px;margin:2em auto;padding:0 1em}}\
         table{{border-collapse:collapse;font-size:90%}}td,th{{border:1px solid #ccc;padding:2px 6px}}\
         img{{max-width:100%}}</style></head><body>\n",
        esc(title)
    );
    let mut in_table = false;
    let mut in_list = false;
    for line in md.lines() {
        let t = line.trim_end();
        if !t.starts_with('|') && in_table {
            html.push_str("</table>\n");
            in_table = false;
        }
        let list_item = t.starts_with("- ");
        let continuation = in_list && t.starts_with("  ") && !t.trim().is_empty();
        if !list_item && !continuation && in_list {
            html.push_str("</ul>\n");
            in_list = false;
        }
        if let Some(h) = t.strip_prefix("### ") {
            writeln!(html, "<h3>{}</h3>", esc(h)).ok();
        } else if let Some(h) = t.strip_prefix("## ") {
            writeln!(html, "<h2>{}</h2>", esc(h)).ok();
        } else if let Some(h) = t.strip_prefix("# ") {
            writeln!(html, "<h1>{}</h1>", esc(h)).ok();
        } else if t.starts_with('|') {
            if t.starts_with("|---") {
                continue;
            }
            let cells: Vec<&str> = t.trim_matches('|').split('|').map(str::trim).collect();
            let tag = if in_table { "td" } else { "th" };
            if !in_table {
                html.push_str("<table>\n");
                in_table = true;
            }
            html.push_str("<tr>");
            for c in cells {
                write!(html, "<{tag}>{}</{tag}>", inline(c)).ok();
            }
            html.push_str("</tr>\n");
        } else if let Some(item) = t.strip_prefix("- ") {
            if !in_list {
                html.push_str("<ul>\n");
                in_list = true;
            }
            write!(html, "<li>{}", inline(item.trim_end_matches("  "))).ok();
        } else if continuation {
            let c = t.trim();
            let c = c.strip_prefix('*').and_then(|c| c.split_once("*:"));
            match c {
                Some((v, rest)) => write!(html, "<br><i>{}</i>:{}", esc(v), inline(rest)).ok(),
                None => write!(html, " {}", inline(t.trim())).ok(),
            };
        } else if t.starts_with("<img") {
            html.push_str(t);
            html.push('\n');
        } else if !t.is_empty() {
            writeln!(html, "<p>{}</p>", inline(t)).ok();
        }
    }
    if in_table {
        html.push_str("</table>\n");
    }
    if in_list {
        html.push_str("</ul>\n");
    }
    html.push_str("</body></html>\n");
    html
}

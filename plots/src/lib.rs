//! kvbench plots: one renderer per figure, Parquet in, PNG + SVG out. Filled in with
//! the figures work; the crate exists now so the workspace has the layout of the
//! architecture page.

//! kvbench datasets: corpora → prompts of exact token length, chat conversations,
//! multiple-choice tasks and the retention task. Filled in by the harness and
//! accuracy work; the crate exists now so the workspace has the layout of the
//! architecture page.

"""The CLI's language-model defaults: TinyGPT, evaluation, the data pipeline and the harness
that maps a CLI config onto hj.make_engine (docs/DESIGN.md, "Layout")."""

"""The heloco-jax console script: train, plot and corpus, and their configs
(docs/DESIGN.md, "Layout")."""

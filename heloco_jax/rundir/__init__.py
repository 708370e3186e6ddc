"""What a run writes: its directory, orbax checkpoints, files opened never through a link,
metric writers (docs/DESIGN.md, "Layout")."""

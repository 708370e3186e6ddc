"""What crosses the wire: pseudo-gradient compressors, θ's fragments (streaming), the syncer,
the uplink and the communication cost model (docs/DESIGN.md, "Layout")."""

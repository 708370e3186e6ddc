"""The pieces of training a run composes: the outer server, the compiled inner loop, the
methods, the rejection policy, membership, checks of user input, sharding and determinism
(docs/DESIGN.md, "Layout")."""

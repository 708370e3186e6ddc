"""ml_collections configs shipped with the package (``default`` is the quickstart)."""

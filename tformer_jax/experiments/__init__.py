"""Small, reproducible experiments built on the library (each has a CLI in scripts/)."""

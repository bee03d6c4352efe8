"""Small framework-free helpers shared across the package."""

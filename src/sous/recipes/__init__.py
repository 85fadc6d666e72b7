"""Vendor recipes: schema, composition, rendering, fit check and launch (issue 3)."""

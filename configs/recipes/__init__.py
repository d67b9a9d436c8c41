"""Recipes: a published model taken through every command (docs/recipe_smollm2.md)."""

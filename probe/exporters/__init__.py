"""Runs turned into things people and other tools read (terminal tables, files)."""

"""The norms op family (see rtckern/ops/__init__.py for the layout every family shares)."""

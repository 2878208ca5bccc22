"""The model families added one module each (models/family.py explains the registry).

Each module declares `FAMILY = Family(...)` (or a `FAMILIES` tuple): its HF config table, the
function that reads its config.json, and its model class, usually a small subclass of the Llama
blocks overriding only what the family changes.
"""

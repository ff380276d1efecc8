"""The model families, one module each: its layers, its `CausalLM` and its `FAMILY`
descriptor (core/model/family.py). A module here that defines `FAMILY` is a family; the
registry finds it by scanning this package, and nothing else in the core names it."""

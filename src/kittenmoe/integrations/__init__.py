"""Optional integrations with other libraries; each module imports its library lazily or on import.

- ``kittenmoe.integrations.transformers``: an ``experts_implementation`` for Hugging Face transformers 5.x.
"""

"""Optional integrations with other libraries; each module imports its library lazily or on import.

- ``kittenmoe.integrations.transformers``: an ``experts_implementation`` for Hugging Face transformers 5.x.
- ``kittenmoe.integrations.torchtitan``: ``apply_kittenmoe`` swaps torchtitan 0.3's ``RoutedExperts`` for one
  ``kittenmoe.moe`` call.
"""

"""cp_cache in other libraries' models: ``cp_cache.integrations.transformers`` (Hugging Face transformers
5.x). Each integration imports its library only when used, so ``import cp_cache`` never needs it."""

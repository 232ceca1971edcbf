"""cp_cache: context-parallel ring attention for Ascend NPUs with a native step-cache store."""

"""The router's plugins (llm-d types); importing this package registers every type."""

from sous.router.plugins import (  # noqa: F401
    approx_prefix,
    kv_cache_utilization_scorer,
    load_aware_scorer,
    pd_deciders,
    pickers,
    precise_prefix,
    prefix_scorer,
    profile_handlers,
    queue_scorer,
    role_filters,
)

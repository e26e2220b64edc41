"""The policies kept for comparison (``iosched replay --policy``): what the default was chosen
against, and what a user may still pick (docs/residency.md).

``coact`` (the default's prefetch over LRU's order), ``moe`` (the density ranking priced per
request, with its own prefetch), ``earned`` (``moe`` while it pays, then ``coact``), ``lfu``,
``lrfu``, ``wtinylfu`` (with its count-min ``sketch``) and ``belady`` (the offline bound, built
by the replay from the trace). Each is a public module of this package.
"""

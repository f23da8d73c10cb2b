"""The one room that touches transformers' or the process's state.

    attention   ColumnMask / ReadingMask and the attention function registered once, at import,
                under our own name (the only change bridgecache makes to transformers' state)
    views       ModelView: twins of the user's module tree that run our attention, and
                generate_view: generate() on a view whose first forward is ours
    graphs      CUDA graphs of the reading and of the native-work pass, per shape bucket
    static      a handoff copied into a transformers StaticCache for compiled decoding

Nothing here keeps state: what a forward needs travels in its masks; graphs and views are owned
by an engine (bridgecache.runtime.state).
"""

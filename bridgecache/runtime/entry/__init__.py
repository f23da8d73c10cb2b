"""The entry points over an engine, and the score they and the evaluation read after a prefix.

handoff       handoff(): one context and prompt, on the setup's shared engine (engine_for)
batch         handoff_batch(): several contexts in one batch
conversation  Conversation: a handoff mid-chat, then turns on the same cache
likelihood    Prefix and score(): log-likelihoods of continuations after a cache (chat, evaluation)

Thin over bridgecache.runtime.engine; nothing below the engine imports them.
"""

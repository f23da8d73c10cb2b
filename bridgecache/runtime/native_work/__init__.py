"""The native work: what the target computes itself over a bridged context, and the forward that does it.

plan        HandoffPlan (plan_handoff): one handoff's decision, frozen: layout, gates, native layers
            and their KV, the selection's budget and columns, groups, the report
pending     PendingWork / PendingPlan: the pending columns per row and the refresh budget
layers      the target's own KV of whole layers (quality gate, selection rules that need them)
forward     the one forward that computes the pending columns with the target's next tokens
generation  the engine's generate(), whose first forward it is
prefill     the native route's prefill (the target's own forward), replayed from a CUDA graph
"""

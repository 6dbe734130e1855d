"""The rules that judge a matched step: propagation, carried state, one-run-only boundaries,
call arguments, routing decisions, and the step judge that applies them in order."""

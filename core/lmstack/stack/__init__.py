"""The stack machinery: parsing a stack file, loading plugins, resolving the stack against the
model (before any weight loads), and building its components."""

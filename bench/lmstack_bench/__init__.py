"""A serving benchmark for any OpenAI-compatible server: `lmstack bench serve`."""

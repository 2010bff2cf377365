"""Structured output: constraints (JSON schema, regex, grammar, choice) as token masks; tool calls."""

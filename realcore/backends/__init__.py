"""Model backends: where weights come from, the built-in generation engine, training engines."""

"""How new weights leave the trainer for the generation servers: through disk, memory or a collective."""

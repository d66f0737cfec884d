"""Contracts only: config models, SequenceSample, engine ABCs and registries. Imports nothing of realcore."""

"""The trainer side: the master (schedule, sample buffer, batch sources, recover, ledger, metrics) and the model workers that hold and train the models."""

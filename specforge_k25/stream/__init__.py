"""Hidden states from the target process(es) to the trainer rank, in memory."""

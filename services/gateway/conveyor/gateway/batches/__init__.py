"""The OpenAI Files and Batches APIs (lines are run by conveyor.batch workers)."""

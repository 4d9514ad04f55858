"""The batch API: OpenAI's /v1/files and /v1/batches, run in the background at low priority,
grouped by model so a batch over many models costs few swaps (docs/teams.md, "Batch API")."""

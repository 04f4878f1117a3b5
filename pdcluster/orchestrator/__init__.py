"""Orchestration: the controller (detached Ray actor owning replica pools, scaling, health), the
router (OpenAI-compatible HTTP endpoint), routing policies, replica states and CLI sessions."""

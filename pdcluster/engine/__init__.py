"""Engine hosting shared by every role: spec (what to run), host (AsyncLLM + OpenAI app),
actor (the Ray actor body), stats (engine-side counters), serve (standalone launcher)."""

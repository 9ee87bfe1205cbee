"""The OpenAI Responses API: a request format on the generation path, and stored responses."""

"""The OpenAI API as the gateway reads it: request bodies (validated once, at arrival)
and their mapping to what the services get."""

"""Serving front ends, clients of the host engine: the asyncio engine and the OpenAI HTTP server."""

"""Model ports that stream on jaxkv caches."""

"""The service's configuration: the builder arguments (builder_args: AppConfig, one section per
concern) and the machinery's tunables (tunables). Nothing is imported here: the rank process reads
its tunables on an image without pydantic."""

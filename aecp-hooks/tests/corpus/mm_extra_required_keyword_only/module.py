def render(template: str, *, strict: bool = False, context: dict) -> str:
    return template

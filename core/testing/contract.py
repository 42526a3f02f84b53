"""What every check raises."""


class ContractError(AssertionError):
    """A component broke its contract; the message says what broke and where."""

"""Built-in speculative-decoding proposers, registered through ``pagoda_proposers``."""

from pagoda import hookimpl


@hookimpl
def pagoda_proposers():
    from pagoda.plugins.spec_decode.draft_model import DraftModelProposer
    from pagoda.plugins.spec_decode.ngram import NgramProposer

    return {"draft_model": DraftModelProposer, "ngram": NgramProposer}

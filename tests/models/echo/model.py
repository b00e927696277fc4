"""Returns every input unchanged, as the output of the same datatype."""


def load(device):
    def run(*inputs):
        return tuple(inputs)

    return run

LOWERS = ("MoeTokenPermuteWithRoutingMap",)


def body(b, node):
    raise NotImplementedError

LOWERS = ("MoeTokenPermuteWithRoutingMapGrad",)


def body(b, node):
    raise NotImplementedError

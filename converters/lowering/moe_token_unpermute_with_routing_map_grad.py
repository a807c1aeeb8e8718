LOWERS = ("MoeTokenUnpermuteWithRoutingMapGrad",)


def body(b, node):
    raise NotImplementedError

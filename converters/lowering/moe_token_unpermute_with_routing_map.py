LOWERS = ("MoeTokenUnpermuteWithRoutingMap",)


def body(b, node):
    raise NotImplementedError

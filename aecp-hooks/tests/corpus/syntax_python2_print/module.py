def f(x: int) -> int:
    print "x is", x
    return x

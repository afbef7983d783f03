-- table.move loops in C over the range it is given, copying nothing.
return { parallelize = function() table.move({}, 1, 1e12, 1, {}) end }

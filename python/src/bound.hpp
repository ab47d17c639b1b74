// How every bound method reaches its C++ object. nanobind lets Python create an instance without
// running __init__ (`Cache.__new__(Cache)`, or a subclass whose __init__ never calls
// super().__init__); its storage is then raw memory. Every method, property and repr of every
// class here is bound through `method`, which checks that the object was initialised and raises
// oasiskv.Error naming the call otherwise, instead of reading that memory.
#pragma once

#include <nanobind/nanobind.h>

#include <string_view>
#include <utility>

#include "oasiskv/error.hpp"

namespace oasiskv::python {

namespace nb = nanobind;

// The C++ object of `self`, or oasiskv.Error when its __init__ has not run.
template <class C>
C& self_of(nb::handle self, const char* call) {
  if (!nb::inst_check(self) || !nb::inst_ready(self)) {
    const std::string_view c(call);
    fail("{}: this {} is not initialised: its __init__ did not run (a subclass's __init__ must call "
         "super().__init__(...))",
         call, c.substr(0, c.find('.')));
  }
  return *nb::inst_ptr<C>(self);
}

// f(C&, args...) bound as a method (or property getter) of the Python class of C: `call` names it
// in the error for an uninitialised object ("Cache.acquire").
template <class C, class R, class... A>
auto method(const char* call, R (*f)(C&, A...)) {
  return [f, call](nb::handle_t<C> self, A... a) -> R { return f(self_of<C>(self, call), std::forward<A>(a)...); };
}
// The same for a method that needs its Python object too (to keep it alive from what it returns).
template <class C, class R, class... A>
auto method(const char* call, R (*f)(nb::handle, C&, A...)) {
  return [f, call](nb::handle_t<C> self, A... a) -> R {
    return f(self, self_of<C>(self, call), std::forward<A>(a)...);
  };
}
// A read-only data member as a property.
template <class C, class M>
auto member(const char* call, M C::*m) {
  return [m, call](nb::handle_t<C> self) -> M { return self_of<C>(self, call).*m; };
}

}  // namespace oasiskv::python

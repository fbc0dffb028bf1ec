package main

import (
	"encoding/base64"
	"encoding/json"
	"math"

	"google.golang.org/protobuf/reflect/protoreflect"
)

// protoJSON is m as JSON the way protojson writes it (field names in
// lowerCamelCase, enums by name, bytes in base64, every field present),
// but with 64-bit integers as numbers: protojson writes them as strings,
// which tools reading `--json` (jq, a dashboard's scraper) take for text.
func protoJSON(m protoreflect.Message) ([]byte, error) {
	return json.MarshalIndent(messageValue(m), "", "  ")
}

func messageValue(m protoreflect.Message) map[string]any {
	out := map[string]any{}
	fields := m.Descriptor().Fields()
	for i := range fields.Len() {
		fd := fields.Get(i)
		v := m.Get(fd)
		switch {
		case fd.IsMap():
			mv := map[string]any{}
			v.Map().Range(func(k protoreflect.MapKey, v protoreflect.Value) bool {
				mv[k.String()] = scalarValue(fd.MapValue(), v)
				return true
			})
			out[fd.JSONName()] = mv
		case fd.IsList():
			l := v.List()
			lv := make([]any, l.Len())
			for j := range l.Len() {
				lv[j] = scalarValue(fd, l.Get(j))
			}
			out[fd.JSONName()] = lv
		case fd.Message() != nil && !m.Has(fd):
			out[fd.JSONName()] = nil
		default:
			out[fd.JSONName()] = scalarValue(fd, v)
		}
	}
	return out
}

// scalarValue is one value of field fd (an element, for lists and maps).
func scalarValue(fd protoreflect.FieldDescriptor, v protoreflect.Value) any {
	switch fd.Kind() {
	case protoreflect.MessageKind, protoreflect.GroupKind:
		return messageValue(v.Message())
	case protoreflect.EnumKind:
		if ev := fd.Enum().Values().ByNumber(v.Enum()); ev != nil {
			return string(ev.Name())
		}
		return int32(v.Enum())
	case protoreflect.BytesKind:
		return base64.StdEncoding.EncodeToString(v.Bytes())
	case protoreflect.FloatKind, protoreflect.DoubleKind:
		if f := v.Float(); math.IsNaN(f) || math.IsInf(f, 0) {
			return v.String() // "NaN", "Infinity": JSON has no number for them
		}
		return v.Float()
	}
	return v.Interface() // bool, string, and the integers as numbers
}

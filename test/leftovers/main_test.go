package leftovers

import (
	"testing"

	"github.com/ckptd/ckptd/test/daemontest"
)

func TestMain(m *testing.M) { daemontest.Main(m) }
